"""DiNa-LRM (Liu et al. 2026, arXiv 2602.11146): a diffusion-native latent reward on SD3.5-Medium latents.

score = head(features of the first N SD3.5 transformer blocks, LoRA-tuned, on the latent noised to sigma ~ u).
The latent x0 (the policy's final latent, `(vae - shift) * scale`) is noised to x = (1 - s) x0 + s eps at the
scheduler sigma s nearest to `u` (timestep t = that sigma's scheduler timestep); the blocks' image and text tokens
after the blocks in `visual_head_idx` / `text_head_idx` (0 = the embedded input) go through FiLM adapters
conditioned on the time-text embedding, a cross-attention head with four query tokens, and the mean over queries
is the raw score. `normalize=True` returns (raw + 10) / 10 as the authors' README and verl-omni
(score_scale 0.1, score_bias 1.0) do; details["raw"] is the raw score.
# source: HKUST-C4G/diffusion-rm@af485b40 diffusion_rm/models/sd3_rm.py (SD3Backbone, SD3RewardModel),
#         diffusion_rm/models/reward_head.py (RewardHead), diffusion_rm/infer/inference.py (DRMInferencer.reward)

Checkpoint (`weights=`: a local copy of liuhuohuo/DiNa-LRM-SD35M-12layers): `config.json` (the training config;
`model:` holds the layer count, the head indices, LoRA and head settings, `backbone_model_id`) and `checkpoint/`:
`backbone_lora/` (a PEFT adapter of the backbone, keys `base_model.model.transformer_blocks.*`) + `rm_head.pt` (the
head's state dict), or `full_model.pt` (backbone + head, no LoRA), or `rm_head.pt` only (frozen backbone). The
backbone and the three text encoders come from the SD3.5-Medium diffusers directory `base=` (default: the config's
`backbone_model_id` when it is a local directory). Prompts are encoded with SD3's CLIP-L + CLIP-G + T5 encoders
(diffusers' `encode_prompt`, the same tokenisation as the authors' `encode_prompt`) at `max_sequence_length` T5
tokens (256 as in the README and verl-omni's rollout). The noise eps is drawn from a generator seeded `noise_seed`
(one draw shared by every sample, so a latent's score does not depend on its batch) or, with `noise_seed=None`, from
the global random stream as the authors do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from mmrl.rewards.base import RewardOutput, register
from mmrl.rewards.image._common import load_state_dict_file, load_strict, read_json, resolve, unique_index
from mmrl.rewards.latent import LatentRewardModel, LatentSpace

WHAT = "dina_lrm"
DOWNLOAD = "'liuhuohuo/DiNa-LRM-SD35M-12layers'"
BASE_DOWNLOAD = "'stabilityai/stable-diffusion-3.5-medium' (a diffusers directory)"
# the attention projections the authors' LoRA targets (sd3_rm.py); PEFT reads them back from adapter_config.json
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


# ------------------------------------------------------------------------------------- the model


class FiLMAdapter(nn.Module):
    """Tokens -> proj_in -> x (1 + gamma) + beta (gamma, beta from the time embedding) + a layer embedding -> proj."""

    def __init__(self, in_dim: int, emb_dim: int, width: int, out_dim: int, use_proj_in: bool):
        super().__init__()
        self.proj_in = nn.Linear(in_dim, width) if (use_proj_in or in_dim != width) else nn.Identity()
        self.layer_embed = nn.Parameter(torch.zeros(1, 1, width))
        self.cond_mlp = nn.Sequential(nn.Linear(emb_dim, 2 * width), nn.SiLU(), nn.Linear(2 * width, 2 * width))
        self.proj = nn.Linear(width, out_dim)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        gamma, beta = self.cond_mlp(temb)[:, None].chunk(2, dim=-1)
        return self.proj(self.proj_in(x) * (1 + gamma) + beta + self.layer_embed)


class GatedCrossAttention(nn.Module):
    """Queries attend to the visual tokens and (with text) separately to the text tokens; the two results add up.
    A token-wise sigmoid gate scales the values (`gated`); RMS norms on queries and contexts; residual output."""

    def __init__(self, dim: int, heads: int, text: bool, gated: bool):
        super().__init__()
        self.heads = heads
        self.norm_q, self.norm_v = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.norm_t = nn.RMSNorm(dim) if text else None
        self.to_q, self.to_k_vis, self.to_v_vis = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_k_text = nn.Linear(dim, dim) if text else None
        self.to_v_text = nn.Linear(dim, dim) if text else None
        self.to_out = nn.Sequential(nn.Linear(dim, dim), nn.Dropout(0.0))
        gate = lambda: nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, 1))  # noqa: E731
        self.gate_vis = gate() if gated else None
        self.gate_text = gate() if gated and text else None

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        split = lambda t: t.unflatten(-1, (self.heads, -1)).transpose(1, 2)  # noqa: E731  [B, H, L, d]
        return F.scaled_dot_product_attention(split(q), split(k), split(v)).transpose(1, 2).flatten(2)

    def _branch(self, q, ctx, norm, to_k, to_v, gate):
        ctx = norm(ctx)
        v = to_v(ctx)
        if gate is not None:
            v = v * torch.sigmoid(gate(ctx))
        return self._attend(q, to_k(ctx), v)

    def forward(self, queries: torch.Tensor, visual: torch.Tensor, text: torch.Tensor | None) -> torch.Tensor:
        q = self.to_q(self.norm_q(queries))
        h = self._branch(q, visual, self.norm_v, self.to_k_vis, self.to_v_vis, self.gate_vis)
        if text is not None and self.to_k_text is not None:
            h = h + self._branch(q, text, self.norm_t, self.to_k_text, self.to_v_text, self.gate_text)
        return queries + self.to_out(h)


class DiNaHead(nn.Module):
    """FiLM adapters per tapped block (visual, text) -> concatenated -> `agg_*` -> query tokens: gated attention
    over visual + text, visual-only attention, FFN -> linear head, mean over the queries. Parameter names are the
    authors' (`rm_head.pt` loads strictly)."""

    def __init__(self, token_dim: int, n_visual: int, n_text: int, t_embed_dim: int, width: int = -1,
                 out_dim: int = 1, num_queries: int = 4, num_attn_heads: int = 8, use_proj_in: bool = False,
                 **_: Any):
        super().__init__()
        width = token_dim if width == -1 else width
        feat = width // 4
        emb = t_embed_dim if t_embed_dim > 0 else width
        adapters = lambda n: nn.ModuleList(FiLMAdapter(token_dim, emb, width, feat, use_proj_in)  # noqa: E731
                                           for _ in range(n))
        self.layer_adapters_visual, self.layer_adapters_text = adapters(n_visual), adapters(n_text)
        self.agg_visual = nn.Linear(n_visual * feat, width) if n_visual else None
        self.agg_text = nn.Linear(n_text * feat, width) if n_text else None
        self.query_tokens = nn.Parameter(torch.zeros(1, num_queries, width))
        self.attn1 = GatedCrossAttention(width, num_attn_heads, text=n_text > 0, gated=True)
        self.attn2 = GatedCrossAttention(width, num_attn_heads, text=False, gated=False)
        self.norm_ff = nn.RMSNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(0.0))
        self.head = nn.Linear(width, out_dim)

    def forward(self, visual: list[torch.Tensor], text: list[torch.Tensor], temb: torch.Tensor) -> torch.Tensor:
        vis = self.agg_visual(torch.cat([a(f, temb) for a, f in zip(self.layer_adapters_visual, visual)], dim=-1))
        txt = (self.agg_text(torch.cat([a(f, temb) for a, f in zip(self.layer_adapters_text, text)], dim=-1))
               if len(self.layer_adapters_text) else None)
        q = self.query_tokens.expand(vis.shape[0], -1, -1)
        q = self.attn2(self.attn1(q, vis, txt), vis, None)
        q = q + self.ff(self.norm_ff(q))
        return self.head(q).mean(dim=1)


class DiNaBackbone(nn.Module):
    """The first `num_layers` blocks of an SD3 transformer returning the time-text embedding and the image / text
    tokens after the tapped blocks. Attribute names are the authors' `SD3Backbone` (LoRA and full_model.pt keys)."""

    def __init__(self, transformer: nn.Module, num_layers: int, visual_idx: list[int], text_idx: list[int]):
        super().__init__()
        self.pos_embed = transformer.pos_embed
        self.time_text_embed = transformer.time_text_embed
        self.context_embedder = transformer.context_embedder
        self.transformer_blocks = nn.ModuleList(transformer.transformer_blocks[:num_layers])
        self.visual_idx, self.text_idx = list(visual_idx), list(text_idx)

    def forward(self, latents, encoder_hidden_states, pooled_projections, timestep):
        h = self.pos_embed(latents)
        temb = self.time_text_embed(timestep, pooled_projections)
        c = self.context_embedder(encoder_hidden_states)
        vis, txt = ([h] if 0 in self.visual_idx else []), ([c] if 0 in self.text_idx else [])
        for i, block in enumerate(self.transformer_blocks, start=1):
            c, h = block(hidden_states=h, encoder_hidden_states=c, temb=temb)
            if i in self.visual_idx:
                vis.append(h)
            if i in self.text_idx:
                txt.append(c)
        return temb, vis, txt


class DiNaModel(nn.Module):
    """backbone + reward_head (+ the logistic's eta3 / eta4 when `use_logistic`): full_model.pt's key layout."""

    def __init__(self, transformer: nn.Module, cfg: dict):
        super().__init__()
        self.backbone = DiNaBackbone(transformer, cfg["num_transformer_layers"], cfg["visual_head_idx"],
                                     cfg["text_head_idx"])
        dim = transformer.config.num_attention_heads * transformer.config.attention_head_dim
        self.reward_head = DiNaHead(dim, len(cfg["visual_head_idx"]), len(cfg["text_head_idx"]), dim,
                                    **cfg.get("reward_head", {}))
        self.use_logistic = bool(cfg.get("use_logistic", False))
        if self.use_logistic:  # the authors' init values (a LoRA checkpoint does not save them)
            self.eta3, self.eta4 = nn.Parameter(torch.tensor(0.0)), nn.Parameter(torch.tensor(0.15))

    def forward(self, latents, encoder_hidden_states, pooled_projections, timestep):
        temb, vis, txt = self.backbone(latents, encoder_hidden_states, pooled_projections, timestep)
        r = self.reward_head(vis, txt, temb)
        if self.use_logistic:  # (eta1 - eta2) sigmoid((r - eta3) / |eta4|) + eta2 with eta1 = 2, eta2 = -2
            r = 4.0 * torch.sigmoid((r - self.eta3) / (self.eta4.abs() + 1e-6)) - 2.0
        return r


# ------------------------------------------------------------------------------------- loading


def read_config(weights: Path) -> dict:
    """The `model:` section of `weights/config.json` (+ `training.add_noise` as `add_noise`), checked."""
    path = weights / "config.json"
    cfg = read_json(path, WHAT, f"'{path}' not found; weights= must be a DiNa-LRM directory holding config.json and "
                                f"checkpoint/ (download {DOWNLOAD})")
    model = cfg.get("model") if isinstance(cfg, dict) else None
    need = ("num_transformer_layers", "visual_head_idx", "text_head_idx", "use_lora", "freeze_backbone")
    if not isinstance(model, dict) or any(k not in model for k in need):
        raise ValueError(f"{WHAT}: '{path}' has no model section with {list(need)} (the DiNa-LRM training config)")
    add_noise = (cfg.get("training") or {}).get("add_noise", True)
    return {**model, "add_noise": bool(add_noise)}


def resolve_base(base: Any, cfg: dict) -> Path:
    """`base=`, else the config's backbone_model_id when it is a local directory; one line otherwise."""
    from mmrl.rewards.image._common import require_path

    if base is None:
        named = str(cfg.get("backbone_model_id", ""))
        if named and Path(named).expanduser().is_dir():
            return Path(named).expanduser()
        raise FileNotFoundError(f"{WHAT}: no base= given and the checkpoint's backbone_model_id {named!r} is not a "
                                f"local directory; download {BASE_DOWNLOAD} and pass base=/path/to/it")
    return require_path(base, f"{WHAT} base", BASE_DOWNLOAD, kind="dir")


def load_checkpoint(model: DiNaModel, ckpt: Path, cfg: dict, trust_pickle: bool) -> DiNaModel:
    """The authors' three layouts; a missing file is one line naming it (the authors only log a warning)."""
    def need(p: Path) -> Path:
        if not p.exists():
            layout = ("LoRA: checkpoint/backbone_lora/ + checkpoint/rm_head.pt" if cfg["use_lora"] else
                      "full: checkpoint/full_model.pt" if not cfg["freeze_backbone"] else
                      "frozen backbone: checkpoint/rm_head.pt")
            raise FileNotFoundError(f"{WHAT}: '{p}' not found; config.json asks for the {layout} layout")
        return p

    if cfg["use_lora"]:
        from peft import PeftModel

        lora = need(ckpt / "backbone_lora")
        head = need(ckpt / "rm_head.pt")
        model.backbone = PeftModel.from_pretrained(model.backbone, str(lora)).merge_and_unload()
        load_strict(model.reward_head, load_state_dict_file(head, WHAT, trust_pickle), WHAT, head)
    elif not cfg["freeze_backbone"]:
        full = need(ckpt / "full_model.pt")
        load_strict(model, load_state_dict_file(full, WHAT, trust_pickle), WHAT, full)
    else:
        head = need(ckpt / "rm_head.pt")
        load_strict(model.reward_head, load_state_dict_file(head, WHAT, trust_pickle), WHAT, head)
    return model


# ------------------------------------------------------------------------------------- the reward


@register("dina_lrm")
class DiNaLRM(LatentRewardModel):
    """DiNa-LRM: SD3.5-Medium latents + prompt -> preference score, no VAE decode (latent reward)."""

    name = "dina_lrm"
    unit = "DiNa-LRM (raw + 10) / 10"

    def __init__(self, weights: Any = None, base: Any = None, *, u: float = 0.4, noise_seed: int | None = 0,
                 normalize: bool = True, max_sequence_length: int = 256, batch_size: int = 8, device: Any = None,
                 dtype: Any = "float32", trust_pickle: bool = False):
        from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

        from mmrl.rewards.image._common import require_path

        if not 0.0 <= float(u) <= 1.0:
            raise ValueError(f"{WHAT}: u (the noise level the latent is scored at) must be in [0, 1], got {u}")
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"{WHAT}: batch_size must be >= 1, got {batch_size}")
        self.device, self.dtype = resolve(device, dtype)
        weights = require_path(weights, WHAT, DOWNLOAD, kind="dir")
        self.cfg = read_config(weights)
        base = resolve_base(base, self.cfg)
        pipe = StableDiffusion3Pipeline.from_pretrained(str(base), vae=None, dtype=self.dtype)
        pipe.set_progress_bar_config(disable=True)
        self.latent_space = LatentSpace("sd3", int(pipe.transformer.config.in_channels))
        self.text = pipe  # its text encoders and tokenizers (the transformer's blocks past N are dropped below)
        self.model = load_checkpoint(DiNaModel(pipe.transformer, self.cfg), weights / "checkpoint", self.cfg,
                                     trust_pickle)
        pipe.transformer = None
        for m in (self.model, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
            if m is not None:
                m.eval().requires_grad_(False).to(device=self.device, dtype=self.dtype)
        sched = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
        self.sigma_table, self.timestep_table = sched.sigmas.float(), sched.timesteps.float()
        self.u, self.noise_seed, self.normalize = float(u), noise_seed, bool(normalize)
        self.max_sequence_length = int(max_sequence_length)

    @classmethod
    def latent_space_of(cls, weights: Any = None, base: Any = None, **_: Any) -> LatentSpace | None:
        try:
            cfg = read_config(Path(weights).expanduser())
            root = resolve_base(base, cfg)
            channels = json.loads((root / "transformer" / "config.json").read_text())["in_channels"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return LatentSpace("sd3", int(channels))

    def to(self, device: Any) -> "DiNaLRM":
        self.device = resolve(device, self.dtype)[0]
        for m in (self.model, self.text.text_encoder, self.text.text_encoder_2, self.text.text_encoder_3):
            if m is not None:
                m.to(self.device)
        return self

    def sigma_timestep(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The scheduler's (sigma, timestep) nearest to `u` (the authors' get_timesteps_from_sigma), float32."""
        i = int(torch.argmin((self.sigma_table - self.u).abs()))
        return self.sigma_table[i], self.timestep_table[i]

    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        uniq, idx = unique_index(prompts)
        pe, _, pooled, _ = self.text.encode_prompt(prompt=uniq, prompt_2=None, prompt_3=None, device=self.device,
                                                   do_classifier_free_guidance=False,
                                                   max_sequence_length=self.max_sequence_length)
        return pe[idx.to(pe.device)], pooled[idx.to(pooled.device)]

    @torch.no_grad()
    def score_latents(self, latents, prompts, metadata):
        x0 = latents.to(self.device, torch.float32)
        sigma, t = self.sigma_timestep()
        if self.cfg["add_noise"]:
            if self.noise_seed is None:
                eps = torch.randn_like(x0)
            else:  # one draw for every sample: a latent's score does not depend on the batch it is in
                eps = torch.randn(x0.shape[1:], generator=torch.Generator().manual_seed(int(self.noise_seed)))
                eps = eps.to(x0.device).expand_as(x0)
            sigma = sigma.to(x0.device)
            x0 = (1.0 - sigma) * x0 + sigma * eps
        pe, pooled = self.encode(prompts)
        timestep = t.to(self.device).expand(x0.shape[0])
        raw = self.model(x0.to(self.dtype), pe, pooled, timestep).float().reshape(-1)
        scores = (raw + 10.0) / 10.0 if self.normalize else raw
        return RewardOutput(scores, {"raw": raw})
