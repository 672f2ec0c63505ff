"""Tiny pipelines of the newer flow-matching families: Wan 2.1 / 2.2 (text-to-video), Z-Image, FLUX.2 [dev] and
FLUX.2 [klein], each the genuine diffusers pipeline class with its real component classes, saved with
``save_pretrained`` (model_index.json + one folder per component) and loaded back by ``from_pretrained``.

Tokenizers are the project's tiny ones (``assets/tokenizers``: T5 for Wan's UMT5, the Qwen BPE for Qwen3) with the
chat template the real pipeline renders; FLUX.2 [dev]'s PixtralProcessor gets a small byte-level BPE trained here
on the corpus plus the pipeline's system message (one token per word, as a real tokenizer mostly has), with
Mistral's control tokens. Every file lands in the pipeline directory, so loading needs no network.

Sizes: transformers of 2 heads x 16, one to two blocks; text encoders of hidden 16-32 (FLUX.2's read hidden
layers (10, 20, 30) / (9, 18, 27), so their encoders have 30 / 27 layers of hidden 16); VAEs with 8 channels.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from mmrl.tiny.components import _prepare_dir, seed_weights, side_effect_free
from mmrl.tiny.vocab import CORPUS_WORDS, _bytes_to_unicode, _load_tokenizer, _vocab_from_merges, train_bpe

# Qwen3's text chat template layout: no default system turn; `enable_thinking=False` appends an empty think block
# (FLUX.2 [klein]); Z-Image renders with enable_thinking=True (nothing appended).
QWEN3_TEXT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")

# Mistral-Small-3.1's layout (the FLUX.2 [dev] text encoder): <s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}")
MISTRAL_CONTROL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                          "[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def _qwen3_tokenizer():
    tok = _load_tokenizer("qwen")
    tok.chat_template = QWEN3_TEXT_CHAT_TEMPLATE
    return tok


def make_mistral_processor():
    """A ``PixtralProcessor`` (FLUX.2 [dev]'s tokenizer slot): byte-level BPE with Mistral's control tokens first,
    trained on the corpus and the words of FLUX.2's system message; an 8-pixel-patch Pixtral image processor."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    b2u = _bytes_to_unicode()
    words = sorted(set(CORPUS_WORDS) | set(re.findall(r"[A-Za-z]+", SYSTEM_MESSAGE)))
    forms = words + [" " + w for w in words] + [x.capitalize() for x in words] + [",", ".", "\n"]
    merges = train_bpe([tuple(b2u[b] for b in f.encode("utf-8")) for f in forms])
    bpe = _vocab_from_merges([b2u[b] for b in range(256)], merges)
    vocab = {t: i for i, t in enumerate(MISTRAL_CONTROL_TOKENS)}
    for t, _ in sorted(bpe.items(), key=lambda kv: kv[1]):
        vocab[t] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="<pad>", model_max_length=131072)
    tok.add_special_tokens({"additional_special_tokens": MISTRAL_CONTROL_TOKENS[4:]})
    images = PixtralImageProcessor(size={"longest_edge": 64}, patch_size={"height": 8, "width": 8})
    return PixtralProcessor(image_processor=images, tokenizer=tok, patch_size=8, spatial_merge_size=1,
                            chat_template=MISTRAL_CHAT_TEMPLATE)


def _flux2_vae(seed: int):
    from diffusers import AutoencoderKLFlux2

    seed_weights(seed)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 8, 8, 8), latent_channels=32, norm_num_groups=4,
                             layers_per_block=1, sample_size=64)
    with torch.no_grad():  # non-trivial batch-norm statistics, so the (de)normalisation is exercised
        vae.bn.running_mean.copy_(0.1 * torch.randn(vae.bn.running_mean.shape))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape))
    return vae


def _flux2_transformer(seed: int, guidance_embeds: bool, text_hidden: int):
    from diffusers import Flux2Transformer2DModel

    seed_weights(seed)
    return Flux2Transformer2DModel(patch_size=1, in_channels=128, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=3 * text_hidden,
                                   axes_dims_rope=(4, 4, 4, 4), guidance_embeds=guidance_embeds)


def _flux2_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # source: black-forest-labs/FLUX.2-dev scheduler/scheduler_config.json (dynamic, exponential time shift)
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                           time_shift_type="exponential")


@side_effect_free
def build_tiny_flux2(path, seed: int = 0) -> Path:
    """Tiny ``Flux2Pipeline`` (FLUX.2 [dev] layout): Flux2Transformer2DModel with a guidance embedding (1 double + 1
    single block), AutoencoderKLFlux2 (32 latent channels, 4 blocks: 64 px <-> 128 x 4 x 4 patchified latents),
    Mistral3ForConditionalGeneration (30 text layers of hidden 16 + a 1-layer Pixtral vision tower),
    PixtralProcessor."""
    from diffusers import Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    path = _prepare_dir(path)
    proc = make_mistral_processor()
    tok = proc.tokenizer
    cfg = Mistral3Config(
        text_config=MistralConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=30,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                  max_position_embeddings=1024, pad_token_id=tok.pad_token_id),
        vision_config=PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, head_dim=8, image_size=64, patch_size=8),
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=1, multimodal_projector_bias=False,
        vision_feature_layer=-1)
    seed_weights(seed + 2)
    text_encoder = Mistral3ForConditionalGeneration(cfg).eval()
    pipe = Flux2Pipeline(scheduler=_flux2_scheduler(), vae=_flux2_vae(seed + 1), text_encoder=text_encoder,
                         tokenizer=proc, transformer=_flux2_transformer(seed, True, 16))
    pipe.save_pretrained(path)
    return path


@side_effect_free
def build_tiny_flux2_klein(path, seed: int = 0, distilled: bool = False) -> Path:
    """Tiny ``Flux2KleinPipeline``: as ``build_tiny_flux2`` without the guidance embedding, with a Qwen3ForCausalLM
    text encoder (27 layers of hidden 16) and the Qwen tokenizer; ``distilled`` sets model_index ``is_distilled``."""
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = _prepare_dir(path)
    tok = _qwen3_tokenizer()
    seed_weights(seed + 2)
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=27, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=1024, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True)).eval()
    pipe = Flux2KleinPipeline(scheduler=_flux2_scheduler(), vae=_flux2_vae(seed + 1), text_encoder=text_encoder,
                              tokenizer=tok, transformer=_flux2_transformer(seed, False, 16), is_distilled=distilled)
    pipe.save_pretrained(path)
    return path


@side_effect_free
def build_tiny_z_image(path, seed: int = 0) -> Path:
    """Tiny ``ZImagePipeline``: ZImageTransformer2DModel (dim 32, 2 layers + 1 refiner layer each, 2 heads,
    16 latent channels as the real one), Qwen3Model text encoder (hidden 32, 3 layers: the pipeline reads the
    second-to-last hidden state), AutoencoderKL (16 latent channels, FLUX.1's scaling 0.3611 / shift 0.1159, 3
    blocks: 64 px <-> 16 x 16 x 16), FlowMatchEuler shift 3 (Z-Image-Turbo's scheduler)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    path = _prepare_dir(path)
    tok = _qwen3_tokenizer()
    seed_weights(seed)
    transformer = ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32,
                                           n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
                                           axes_dims=[4, 6, 6], axes_lens=[512, 64, 64])
    with torch.no_grad():  # padding tokens are learned parameters; give them values a trained model would have
        transformer.x_pad_token.normal_(0, 0.02)
        transformer.cap_pad_token.normal_(0, 0.02)
    seed_weights(seed + 1)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, down_block_types=("DownEncoderBlock2D",) * 3,
                        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(8, 16, 16), layers_per_block=1,
                        norm_num_groups=8, sample_size=64, scaling_factor=0.3611, shift_factor=0.1159,
                        use_quant_conv=False, use_post_quant_conv=False)
    seed_weights(seed + 2)
    text_encoder = Qwen3Model(Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                                          head_dim=16, max_position_embeddings=1024,
                                          pad_token_id=tok.pad_token_id)).eval()
    # source: Tongyi-MAI/Z-Image-Turbo scheduler/scheduler_config.json (shift 3, no dynamic shifting)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                   transformer=transformer).save_pretrained(path)
    return path


WAN_VARIANTS = ("2.1", "2.2_a14b", "2.2_ti2v")


@side_effect_free
def build_tiny_wan(path, seed: int = 0, variant: str = "2.1", scheduler: str = "euler") -> Path:
    """Tiny ``WanPipeline`` (text-to-video) at ``path``.

    variant "2.1": one WanTransformer3DModel (patch (1, 2, 2), 2 heads x 16, 2 blocks, text_dim 32), AutoencoderKLWan
    (z 16, 8 base channels, spatial x8 / temporal x4: 32 px x 5 frames <-> 16 x 2 x 4 x 4), UMT5 encoder (d_model 32).
    "2.2_a14b": two such transformers (high- and low-noise experts) and ``boundary_ratio`` 0.875 (Wan2.2-T2V-A14B's).
    "2.2_ti2v": Wan2.2-TI2V-5B's layout: ``expand_timesteps``, the residual VAE with 2x2 patching (z 48, spatial x16),
    a 48-channel transformer. scheduler "euler": FlowMatchEulerDiscreteScheduler(shift 3); "unipc": the published
    UniPCMultistepScheduler (flow sigmas, flow_shift 3, as Wan2.1-T2V-1.3B-Diffusers at 480p).
    """
    from diffusers import (AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanPipeline,
                           WanTransformer3DModel)
    from transformers import UMT5Config, UMT5EncoderModel

    if variant not in WAN_VARIANTS:
        raise ValueError(f"build_tiny_wan: unknown variant {variant!r}; valid: {list(WAN_VARIANTS)}")
    if scheduler not in ("euler", "unipc"):
        raise ValueError(f"build_tiny_wan: scheduler must be 'euler' or 'unipc', got {scheduler!r}")
    path = _prepare_dir(path)
    tok = _load_tokenizer("t5")
    ti2v = variant == "2.2_ti2v"
    channels = 48 if ti2v else 16

    def transformer(s: int):
        seed_weights(s)
        return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                     in_channels=channels, out_channels=channels, text_dim=32, freq_dim=256,
                                     ffn_dim=64, num_layers=2, rope_max_seq_len=64)

    seed_weights(seed + 1)
    if ti2v:  # random per-channel statistics of the right length (the real ones are 48 published numbers)
        stats = dict(latents_mean=(0.2 * torch.randn(48)).tolist(), latents_std=(0.5 + torch.rand(48)).tolist())
        vae = AutoencoderKLWan(base_dim=8, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1, is_residual=True,
                               in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
                               temperal_downsample=[False, True, True], **stats)
    else:
        vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True])
    seed_weights(seed + 2)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        relative_attention_max_distance=32, feed_forward_proj="gated-gelu", dropout_rate=0.0,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.pad_token_id)).eval()
    if scheduler == "unipc":
        # source: Wan-AI/Wan2.1-T2V-1.3B-Diffusers scheduler/scheduler_config.json (flow_shift 3.0 for 480p)
        sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                        num_train_timesteps=1000)
    else:
        sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    extra = {}
    if variant == "2.2_a14b":
        # boundary 0.875: verl-omni wan22 rollout adapter default for Wan2.2-T2V-A14B (facts/MODEL_FAMILIES.md)
        extra = dict(transformer_2=transformer(seed + 3), boundary_ratio=0.875)
    pipe = WanPipeline(tokenizer=tok, text_encoder=text_encoder, vae=vae, scheduler=sched,
                       transformer=transformer(seed), expand_timesteps=ti2v, **extra)
    pipe.save_pretrained(path)
    return path
