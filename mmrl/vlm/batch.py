"""`RolloutBatch`: one RL step's token rows, padded ONCE, shared by the reference pass, the old-log-prob pass and
every training micro-batch (no re-collate, no re-rope-index, no tensor -> list -> re-padded tensor round trips).

Row layout (the layout batched generation with left padding produces, see ``mmrl.vlm.common``)::

    columns:  0 ........................ P-1 | P ...................... P+T-1
    row b:    [pad .. pad | prompt tokens b ] [response tokens b | pad .. pad]
              left padding (prompt_len P)      right padding (response length T)

"prompt" is whatever conditions the scored tokens (a single-turn prompt, or a multi-turn episode's first prompt);
"response" is everything after it (for multi-turn rows: policy turns AND the observations between them, told
apart by ``loss_mask``). Response token t of row b sits at column P + t; every [N, T] field is aligned with the
response tokens: ``x[b, t]`` belongs to response token t of row b (the token predicted by the logits at column
P + t - 1). Values at padded positions (``response_mask`` false) are 0.

Fields (N rows, L = P + T columns; all tensors on one device):
  input_ids          long[N, L]     pad id at padded positions
  attention_mask     long[N, L]     1 at real tokens
  position_ids       long[3, N, L]  M-RoPE index (``get_rope_index``) computed once for the whole batch
  one_d              bool           the family has plain 1-D positions (InternVL): the 3 rows are equal and the
                                    model gets one (``mmrl.vlm.families``)
  mm_token_type_ids  long[N, L]     0 text / 1 image pad / 2 video pad
  prompt_lens        long[N]        real prompt tokens per row;  response_lens long[N]: real response tokens
  prompt_len         int            P (columns of the prompt part)
  response_mask      bool[N, T]     real response tokens
  loss_mask          bool[N, T]     tokens the policy loss covers (default: response_mask; multi-turn: policy turns)
  mm                 list[dict]     per row: {"pixel_values" [patches, D], "image_grid_thw" [n, 3], ...} or {};
                                    rows of one prompt may share one dict (a ``VisionCache`` keys on its tensors)
  advantages         float32[N] (per sequence) or float32[N, T] (per token), or None
  old_logprobs, ref_logprobs, rollout_logprobs   float32[N, T] or None
  weights            float32[N]     1 for rows that count, 0 for placeholder rows (a rank that kept nothing still
                                    runs a forward/backward so collectives pair; see ``mmrl.vlm.update``)
  packed             bool           forwards run padding-free (``pack``: the rows' real tokens packed into bins of
                                    ``pack_length`` tokens (0: the longest row) with block-diagonal masks; LightRFT's
                                    packing); equal log-probs up to float order
  pack_length        int            tokens per packed row (at least the longest row; 0 = the longest row)
  pad_id             int            the pad token id (fills the end of a packed row)

Slicing: ``select(rows)`` (and ``micro_batches(size)``) keep the chosen rows and cut the columns that are padding
in all of them, so a selection is exactly what collating those rows alone would give (ids, masks, positions: the
rope index of a row does not depend on how much padding it has); log-probs from it equal the old per-micro-batch
collate path bit for bit (tests/vlm/test_grpo.py::test_rollout_batch_logprobs_equal_collate_path).

Log-probs are ``log_softmax(logits / temperature)`` at the chosen tokens, in float32 (``token_logprobs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterator, Sequence

import torch

from mmrl.pipelines.qwen_vl import get_rope_index, mm_token_type_ids, rope_kwargs_from_config
from mmrl.vlm.families import family_of_config

Tensor = torch.Tensor
_MM_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
_PER_TOKEN = ("response_mask", "loss_mask", "old_logprobs", "ref_logprobs", "rollout_logprobs")


def pad_to(rows: Sequence[Sequence[float]], value: float, dtype: torch.dtype, left: bool = False,
           length: int | None = None) -> torch.Tensor:
    """Stack ragged rows into [B, max_len] (or ``length``), padding on the right (or left)."""
    T = max([len(r) for r in rows] + [0]) if length is None else length
    out = torch.full((len(rows), T), value, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            t = torch.as_tensor(list(r), dtype=dtype)
            if left:
                out[i, T - len(r):] = t
            else:
                out[i, :len(r)] = t
    return out


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Row indices grouped into bins whose lengths sum to at most `capacity` (>= every length): first fit
    decreasing (rows by decreasing length, ties in row order, each into the first bin with room). Deterministic."""
    if lengths and max(lengths) > capacity:
        raise ValueError(f"pack_rows: a row of {max(lengths)} tokens does not fit a capacity of {capacity}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = next((k for k, left in enumerate(room) if left >= lengths[i]), None)
        if k is None:
            bins.append([])
            room.append(capacity)
            k = len(bins) - 1
        bins[k].append(i)
        room[k] -= lengths[i]
    return bins


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(logits / temperature)[tokens] in float32; logits[B, T, V], tokens[B, T] -> [B, T].

    The entropy (of the same tempered distribution) carries gradients only with ``entropy_grad`` (a bonus in
    the loss); as a metric it is computed without building a [B, T, V] graph."""
    x = logits.float()
    if temperature not in (0.0, 1.0):
        x = x / temperature
    logz = torch.logsumexp(x, -1)
    logp = x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - logz
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            p = torch.softmax(x, -1)
            entropy = logz - (p * x).sum(-1)
    return logp, entropy


def _rows_tensor(rows: Any, T: int, device: Any) -> Tensor | None:
    """float32[N, T] from a list of 1-D tensors/lists (ragged, right-padded with 0) or a [N, >=T] tensor."""
    if rows is None:
        return None
    if isinstance(rows, Tensor) and rows.dim() == 2:
        out = torch.zeros(rows.shape[0], T, dtype=torch.float32)
        k = min(T, rows.shape[1])
        out[:, :k] = rows[:, :k].float().cpu()
        return out.to(device)
    return pad_to([torch.as_tensor(r, dtype=torch.float32).tolist() for r in rows], 0.0, torch.float32,
                  length=T).to(device)


def cat_mm(mm: Sequence[dict], device: Any = None, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The rows' vision tensors concatenated in row order (pixel values cast to `dtype` when given)."""
    out: dict[str, Tensor] = {}
    for key in _MM_KEYS:
        parts = [m[key] for m in mm if m and key in m]
        if parts:
            t = torch.cat(parts, 0)
            if device is not None:
                t = t.to(device)
            if dtype is not None and key.startswith("pixel_values"):
                t = t.to(dtype)
            out[key] = t
    return out


@dataclass
class RolloutBatch:
    """One step's rows padded once; see the module docstring for the layout, fields, shapes and alignment."""

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    mm_token_type_ids: Tensor
    prompt_lens: Tensor
    response_lens: Tensor
    prompt_len: int
    response_mask: Tensor
    loss_mask: Tensor
    mm: list = field(default_factory=list)
    advantages: Tensor | None = None
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    rollout_logprobs: Tensor | None = None
    weights: Tensor | None = None
    packed: bool = False
    one_d: bool = False
    pack_length: int = 0
    pad_id: int = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, model: Any, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
              mm: Sequence[dict], pad_id: int, *, loss_mask: Sequence[Sequence[int]] | None = None,
              advantages: Any = None, old_logprobs: Any = None, ref_logprobs: Any = None,
              rollout_logprobs: Any = None, weights: Sequence[float] | None = None) -> "RolloutBatch":
        """Pad `prompt_ids` (left) and `response_ids` (right) once, compute the rope index once, on the device of
        `model` (any module with ``.config`` and parameters; a peft / DDP wrapper is fine).

        `loss_mask`: per row, 0/1 per response token (default: every response token). `advantages`: [N] values
        (per sequence) or per-row sequences of per-token values ([N, T] after padding). `*_logprobs`: per-row
        1-D sequences of response-token log-probs (ragged) or a float [N, >=T] tensor. `weights`: per row
        (default 1)."""
        if not len(prompt_ids) or len(prompt_ids) != len(response_ids) or len(mm) != len(prompt_ids):
            raise ValueError(f"RolloutBatch.build: need N >= 1 rows with equal counts, got {len(prompt_ids)} prompts, "
                             f"{len(response_ids)} responses, {len(mm)} mm dicts")
        device = next(model.parameters()).device
        cfg = getattr(model, "config", None)
        prompts = pad_to(prompt_ids, pad_id, torch.long, left=True)
        p_mask = pad_to([[1] * len(p) for p in prompt_ids], 0, torch.long, left=True)
        T = max([len(r) for r in response_ids] + [0])
        resp = pad_to(response_ids, pad_id, torch.long, length=T)
        r_mask = pad_to([[1] * len(r) for r in response_ids], 0, torch.long, length=T)
        input_ids = torch.cat([prompts, resp], 1).to(device)
        attn = torch.cat([p_mask, r_mask], 1).to(device)
        grids = cat_mm(mm, device)
        one_d = family_of_config(cfg).rope == "1d"
        if one_d:  # plain positions over the real tokens (InternVL), as 3 equal rows: slicing stays the same
            position_ids = ((attn.cumsum(-1) - 1).clamp(min=0) * attn).unsqueeze(0).expand(3, -1, -1).contiguous()
        else:
            position_ids, _ = get_rope_index(input_ids, attn, grids.get("image_grid_thw"),
                                             grids.get("video_grid_thw"), **rope_kwargs_from_config(cfg))
        resp_mask = r_mask.bool().to(device)
        lmask = resp_mask if loss_mask is None else \
            pad_to(loss_mask, 0, torch.long, length=T).bool().to(device) & resp_mask
        adv = None
        if advantages is not None:
            if isinstance(advantages, Tensor) and advantages.dim() == 1:
                adv = advantages.detach().float().to(device)
            else:
                adv = _rows_tensor(advantages, T, device)
        w = torch.ones(len(prompt_ids)) if weights is None else torch.as_tensor(list(weights), dtype=torch.float32)
        return cls(input_ids=input_ids, attention_mask=attn, position_ids=position_ids,
                   mm_token_type_ids=mm_token_type_ids(input_ids, cfg.image_token_id,
                                                       getattr(cfg, "video_token_id", -1)),  # InternVL: none
                   one_d=one_d,
                   prompt_lens=torch.tensor([len(p) for p in prompt_ids]),
                   response_lens=torch.tensor([len(r) for r in response_ids]), prompt_len=prompts.shape[1],
                   response_mask=resp_mask, loss_mask=lmask, mm=list(mm), advantages=adv,
                   old_logprobs=_rows_tensor(old_logprobs, T, device),
                   ref_logprobs=_rows_tensor(ref_logprobs, T, device),
                   rollout_logprobs=_rows_tensor(rollout_logprobs, T, device), weights=w.to(device), pad_id=int(pad_id))

    def per_token(self, rows: Any) -> Tensor:
        """float32[N, T] aligned with this batch's response tokens from ragged rows or a [N, >=T] tensor (e.g. token
        advantages or log-probs computed elsewhere); set it with ``batch.<field> = batch.per_token(x)``."""
        return _rows_tensor(rows, self.response_len, self.input_ids.device)

    # ------------------------------------------------------------------ shape
    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_len(self) -> int:
        """T: columns of the response part."""
        return int(self.input_ids.shape[1]) - self.prompt_len

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def loss_tokens(self) -> float:
        """Number of loss-mask tokens (float)."""
        return float(self.loss_mask.sum())

    # ------------------------------------------------------------------ slicing
    def select(self, rows: Sequence[int]) -> "RolloutBatch":
        """The batch of `rows` (in that order), with the columns that are padding in all of them cut: equal to
        building a batch of those rows alone. `rows` must be non-empty."""
        rows = list(rows)
        if not rows:
            raise ValueError("RolloutBatch.select: no rows")
        idx = torch.tensor(rows, dtype=torch.long)
        P_sub = int(self.prompt_lens[idx].max())
        T_sub = int(self.response_lens[idx].max())
        cols = slice(self.prompt_len - P_sub, self.prompt_len + T_sub)
        di = idx.to(self.device)
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("input_ids", "attention_mask", "mm_token_type_ids"):
                v = v[di][:, cols]
            elif f.name == "position_ids":
                v = v[:, di][:, :, cols]
            elif f.name in ("prompt_lens", "response_lens"):
                v = v[idx]
            elif f.name == "prompt_len":
                v = P_sub
            elif f.name == "mm":
                v = [v[i] for i in rows]
            elif f.name in ("packed", "one_d", "pack_length", "pad_id"):
                pass
            elif f.name in _PER_TOKEN or (f.name == "advantages" and v is not None and v.dim() == 2):
                v = None if v is None else v[di][:, :T_sub]
            elif v is not None:  # advantages [N], weights [N]
                v = v[di]
            out[f.name] = v
        return RolloutBatch(**out)

    def micro_batch_rows(self, size: int, rows: Sequence[int] | None = None) -> list[list[int]]:
        """`rows` (default all) in contiguous chunks of at most `size`."""
        rows = list(range(len(self))) if rows is None else list(rows)
        size = max(1, int(size))
        return [rows[i:i + size] for i in range(0, len(rows), size)]

    def micro_batches(self, size: int, rows: Sequence[int] | None = None) -> Iterator["RolloutBatch"]:
        """`select` of each chunk of :meth:`micro_batch_rows`."""
        for chunk in self.micro_batch_rows(size, rows):
            yield self.select(chunk)

    # ------------------------------------------------------------------ forward
    def model_inputs(self, dtype: torch.dtype | None = None, vision_cache: Any = None) -> dict[str, Any]:
        """kwargs for ``model(**kwargs)`` (pixel values cast to `dtype`, the model's); with a ``VisionCache`` the
        images' cached encoder outputs replace ``pixel_values``."""
        kw: dict[str, Any] = dict(input_ids=self.input_ids, attention_mask=self.attention_mask,
                                  position_ids=self.position_ids[0] if self.one_d else self.position_ids,
                                  mm_token_type_ids=self.mm_token_type_ids,
                                  **cat_mm(self.mm, self.device, dtype))
        if vision_cache is not None:
            kw = vision_cache.apply(kw, self.mm)
        return kw

    def forward_logprobs(self, model: Any, temperature: float = 1.0, *, with_entropy: bool = False,
                         entropy_grad: bool = False, vision_cache: Any = None, dtype: torch.dtype | None = None
                         ) -> tuple[Tensor, Tensor | None]:
        """(log-probs float32[N, T], entropies [N, T] or None) of this batch's response tokens in one forward
        (gradients flow if enabled). Only the response positions' logits are materialised (``logits_to_keep``).
        `model` may be DDP/FSDP-wrapped; `dtype`: the pixel dtype (default: ``model.dtype`` when it has one)."""
        T = self.response_len
        if dtype is None:
            dtype = getattr(getattr(model, "module", model), "dtype", None)
        if self.packed:
            return self._packed_forward_logprobs(model, temperature, with_entropy, entropy_grad, vision_cache, dtype)
        out = model(**self.model_inputs(dtype, vision_cache), use_cache=False, logits_to_keep=T + 1)
        logits = out.logits[:, :T]  # logits at columns P-1 .. P+T-2 predict response tokens 0 .. T-1
        resp = self.input_ids[:, self.prompt_len:]
        return token_logprobs(logits, resp.to(logits.device), temperature, with_entropy, entropy_grad)

    @torch.no_grad()
    def logprobs(self, model: Any, micro_batch_size: int, temperature: float = 1.0, *, vision_cache: Any = None,
                 with_entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Response-token log-probs of every row, float32[N, T] on this batch's device (0 at padding), in
        micro-batches of `micro_batch_size` rows, no grad; with `with_entropy` also the entropies [N, T]."""
        N, T = len(self), self.response_len
        lp = torch.zeros(N, T, dtype=torch.float32, device=self.device)
        ent = torch.zeros(N, T, dtype=torch.float32, device=self.device) if with_entropy else None
        for chunk in self.micro_batch_rows(micro_batch_size):
            sub = self.select(chunk)
            l, e = sub.forward_logprobs(model, temperature, with_entropy=with_entropy, vision_cache=vision_cache)
            t = sub.response_len
            idx = torch.tensor(chunk, device=self.device)
            lp[idx, :t] = l.float().to(self.device) * sub.response_mask
            if ent is not None:
                ent[idx, :t] = e.float().to(self.device) * sub.response_mask
        return (lp, ent) if with_entropy else lp

    # ------------------------------------------------------------------ padding-free forwards (packed=True)
    def pack(self, dtype: torch.dtype | None = None, vision_cache: Any = None
             ) -> tuple[dict[str, Any], Tensor, Tensor, Tensor]:
        """(model kwargs of R packed rows, logits_to_keep: long[K] columns, index [N, T] of each response token into
        the [R * K] flattened kept logits, valid [N, T]).

        The rows' real tokens (no padding) go into bins of at most ``max(pack_length, longest row)`` tokens, first
        fit decreasing (`pack_rows`): R <= N rows of width W. Text positions restart at 0 at each sequence boundary:
        transformers then builds a block-diagonal causal mask when no attention mask is given
        (`masking_utils.find_packed_sequence_indices`), and Qwen-VL takes position ids [4, R, W] = (text positions,
        the 3 M-RoPE rows of each row's padded index). A bin shorter than W ends in a filler sequence of pad tokens
        (positions restarting at 0: its own block, which no real token attends to; its logits are never read). The
        images go in the order their rows are packed. Logits are only computed at the columns that predict a
        response token of some bin (``logits_to_keep``): row b's response token t is predicted at column
        offset_b + prompt_lens[b] + t - 1 of its bin."""
        keep = self.attention_mask.bool()
        lens = keep.sum(-1).tolist()
        bins = pack_rows(lens, max(self.pack_length, max(lens)))
        order = [i for b in bins for i in b]
        R, W = len(bins), max(sum(lens[i] for i in b) for b in bins)
        dev = self.input_ids.device
        ids = torch.full((R, W), self.pad_id, dtype=self.input_ids.dtype, device=dev)
        pos = torch.zeros((4, R, W), dtype=self.position_ids.dtype, device=dev)
        types = torch.zeros((R, W), dtype=self.mm_token_type_ids.dtype, device=dev)
        bin_of, offset = [0] * len(lens), [0] * len(lens)
        for r, b in enumerate(bins):
            o = 0
            for i in b:
                n, k = lens[i], keep[i]
                ids[r, o:o + n] = self.input_ids[i, k]
                pos[0, r, o:o + n] = torch.arange(n, device=dev)
                pos[1:, r, o:o + n] = self.position_ids[:, i, k]
                types[r, o:o + n] = self.mm_token_type_ids[i, k]
                bin_of[i], offset[i] = r, o
                o += n
            if o < W:  # filler sequence: positions restart at 0 (a block of its own)
                pos[:, r, o:] = torch.arange(W - o, device=dev)
        mm = [self.mm[i] for i in order]  # the images in packed order
        kw: dict[str, Any] = dict(input_ids=ids, position_ids=pos[0] if self.one_d else pos, mm_token_type_ids=types,
                                  **cat_mm(mm, self.device, dtype))
        if vision_cache is not None:
            kw = vision_cache.apply(kw, mm)
        t = torch.arange(self.response_len, device=dev)
        valid = self.response_mask.to(dev)
        col = (torch.tensor(offset, device=dev) + self.prompt_lens.to(dev))[:, None] + t[None] - 1  # [N, T]
        cols = torch.unique(col[valid])  # sorted
        if not len(cols):  # no response token at all: one column keeps the shapes (every value is masked)
            cols = col.new_zeros(1)
        at = torch.searchsorted(cols, col).clamp(max=len(cols) - 1)  # exact where valid
        index = torch.tensor(bin_of, device=dev)[:, None] * len(cols) + at
        return kw, cols, torch.where(valid, index, torch.zeros_like(index)), valid

    def _packed_forward_logprobs(self, model: Any, temperature: float, with_entropy: bool, entropy_grad: bool,
                                 vision_cache: Any, dtype: torch.dtype | None) -> tuple[Tensor, Tensor | None]:
        kw, cols, index, valid = self.pack(dtype, vision_cache)
        logits = model(**kw, use_cache=False, logits_to_keep=cols).logits  # [R, K, V]: response columns only
        picked = logits.reshape(-1, logits.shape[-1])[index.reshape(-1)].reshape(*index.shape, -1)  # [N, T, V]
        resp = self.input_ids[:, self.prompt_len:].to(logits.device)
        lp, ent = token_logprobs(picked, resp, temperature, with_entropy, entropy_grad)
        zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
        return torch.where(valid, lp, zero), (None if ent is None else torch.where(valid, ent, zero))

    def replace(self, **changes: Any) -> "RolloutBatch":
        """A copy with some fields replaced (``dataclasses.replace``)."""
        return replace(self, **changes)
