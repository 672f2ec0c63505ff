"""Single-turn VLM rollouts for the GRPO recipe: data streams, prompt requests, scoring (+ DAPO overlong penalty),
group collection with DAPO dynamic sampling (`rollout_step`: one step's rollout, the same function in the trainer and
in a rollout process), greedy evaluation. Functions take the recipe config (`cfg`: its `data`, `rollout`, `reward`,
`algo` sections)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from mmrl.core import keep_groups, overlong_penalty
from mmrl.pipelines.data import PromptSampler, VQAItem, load_visual_qa
from mmrl.pipelines.shapes_qa import ShapesQA
from mmrl.training import NONFINITE_KEY, check_rewards, finite_stats, group_keep
from mmrl.vlm.common import encode_prompt, messages_from_text, render_prompt
from mmrl.vlm.rollout import GenRequest, SamplingParams, make_engine


def build_data(cfg: Any) -> tuple[Any, list[VQAItem]]:
    """(resumable training stream with .next(n)/.state_dict(), fixed eval items)."""
    data = cfg.data
    if data.kind == "shapes":
        return ShapesQA(data, cfg.seed), ShapesQA(data, cfg.seed + 7919).next(data.eval_size)
    if data.kind == "geo3k":
        if not data.path:
            raise ValueError("data.path: geo3k data needs a .jsonl/.json/.parquet file or a save_to_disk directory")
        kw = dict(image_root=data.image_root or None, template=data.template, on_error=data.on_error)
        items = load_visual_qa(data.path, limit=data.limit or None, **kw)
        evals = load_visual_qa(data.val_path, limit=data.eval_size, **kw) if data.val_path and data.eval_size else []
        return PromptSampler(items, seed=cfg.seed), evals
    raise ValueError(f"data.kind: expected 'shapes' or 'geo3k', got {data.kind!r}")


def to_request(item: VQAItem, processor: Any, data: Any, n: int | None = None) -> GenRequest:
    text = render_prompt(processor, messages_from_text(item.prompt, data.system_prompt or None))
    images = list(item.images)
    if data.min_pixels or data.max_pixels:
        from mmrl.pipelines.images import resize_for_qwen

        images = [resize_for_qwen(im, data.min_pixels or None, data.max_pixels or None) for im in images]
    return GenRequest(prompt_text=text, images=images, n=n, metadata=item.metadata)


def score(reward_model: Any, results: list, cfg: Any, validate: bool = False, details: dict | None = None
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(scores[B] incl. overlong penalty, components {name: [B]}, accuracy[B]).

    `validate`: NaN/inf scores raise naming the component and the response (`reward.on_nonfinite: error`), or stay
    in the scores as the mark of a dropped sample (`drop_sample`; `collect_rollouts` keeps only finite ones).
    `details`: a dict that receives the reward's whole details (e.g. the parsed answers, `extracted`)."""
    out = reward_model(completions=[r.text for r in results], metadata=[r.metadata for r in results])
    if details is not None:
        details.update(out.details)
    base = out.scores.float()
    if validate:
        check_rewards(base, out.details, cfg.reward.on_nonfinite, reward=getattr(reward_model, "name", cfg.reward.name),
                      components=list(getattr(reward_model, "components", {})),
                      labels=[f"prompt {r.request_index}, response {r.sample_index}: {r.text[:40]!r}" for r in results])
    comps = {k: v.float() for k, v in out.details.items() if isinstance(v, torch.Tensor) and v.shape == base.shape}
    key = cfg.reward.accuracy_key
    acc = comps[key] if key else (base > 0.5).float()
    lengths = torch.tensor([len(r.response_ids) for r in results])
    pen = overlong_penalty(lengths, cfg.rollout.max_new_tokens, cfg.reward.overlong_buffer, cfg.reward.overlong_penalty)
    if cfg.reward.overlong_buffer > 0:
        comps["overlong"] = pen
    return base + pen, comps, acc


@dataclass
class Rollouts:
    """What one step trains on (kept groups, request-major) plus every generated sample's score for logging."""

    results: list
    items: list
    scores: torch.Tensor
    comps: dict
    group_ids: torch.Tensor
    all_scores: torch.Tensor
    all_acc: torch.Tensor
    rounds: int
    all_kinds: list = field(default_factory=list)
    nonfinite: int = 0  # samples dropped for a NaN/inf reward (reward.on_nonfinite: drop_sample)


def collect_rollouts(next_items: Callable[[int], list], generate: Callable[[list], list],
                     score_fn: Callable[[list], tuple], batch_size: int, n: int, dynamic: bool,
                     max_rounds: int, count: Callable[[list], int] = len) -> Rollouts:
    """Generate `n` responses for `batch_size` prompts; with `dynamic` (DAPO) drop groups whose rewards are all
    equal and generate further rounds (at most `max_rounds`) until `batch_size` groups are kept.

    `generate(items) -> results` (each with `.request_index` into items), `score_fn(results) -> (scores[B],
    components {name: [B]}, accuracy[B])`. Without `dynamic` exactly one round is kept whole. `count(kept)` is
    the kept sample count the stopping rule reads (several processes: the minimum over ranks, so every rank runs
    the same rounds and consumes the same global data). A non-finite score marks a dropped sample: it is never
    kept, and neither is the rest of a group left with fewer than 2 finite scores (with n >= 2)."""
    # source: DAPO arXiv 2503.14476 sec. 3.2 (dynamic sampling); verl dapo ray_trainer (max_num_gen_batches)
    kept, kept_items, S, C, gids, all_s, all_a, kinds = [], [], [], {}, [], [], [], []
    rounds = nonfinite = 0
    while rounds < (max(1, max_rounds) if dynamic else 1) and count(kept) < batch_size * n:
        rounds += 1
        items = next_items(batch_size)
        results = generate(items)
        scores, comps, acc = score_fn(results)
        all_s.append(scores), all_a.append(acc)
        kinds += [getattr(r, "metadata", {}).get("kind") for r in results]
        ids = torch.tensor([r.request_index for r in results])
        finite = torch.isfinite(scores)
        nonfinite += int((~finite).sum())
        keep = group_keep(finite, ids, min_size=min(2, n))  # all True when every score is finite
        if dynamic and keep.any():
            keep[keep.clone()] = keep_groups(scores[keep], ids[keep])
        for i in keep.nonzero().flatten().tolist():
            if len(kept) >= batch_size * n:
                break
            kept.append(results[i])
            kept_items.append(items[results[i].request_index])
            S.append(scores[i]), gids.append(rounds * 1_000_000 + results[i].request_index)
            for k, v in comps.items():
                C.setdefault(k, []).append(v[i])
    empty = torch.zeros(0)
    return Rollouts(kept, kept_items, torch.stack(S) if S else empty, {k: torch.stack(v) for k, v in C.items()},
                    torch.tensor(gids, dtype=torch.long), torch.cat(all_s), torch.cat(all_a), rounds, kinds, nonfinite)


def sampling_params(rollout: Any) -> SamplingParams:
    """The training rollouts' sampling settings of a `rollout:` section."""
    return SamplingParams(n=rollout.group_size, temperature=rollout.temperature, top_p=rollout.top_p,
                          top_k=rollout.top_k, max_new_tokens=rollout.max_new_tokens, stop=rollout.stop)


def rollout_step(cfg: Any, engine: Any, processor: Any, reward_model: Any, data: Any, shards: Any, timer: Any, *,
                 count: Callable[[list], int] = len, check_images: bool = False) -> tuple[Rollouts, list]:
    """One step's rollouts of this rank, in the trainer (rollout.worker=inline) or in its rollout process: its
    contiguous share (`shards`: a `DistContext`) of `rollout.prompts_per_step` prompts from `data`, `group_size`
    responses each from `engine`, scored with `reward_model` (`reward.on_nonfinite` checked), with DAPO's rounds
    (`algo.dynamic_sampling`, `algo.max_gen_batches`; `count` as in `collect_rollouts`); timed as rollout/reward
    in `timer`. `check_images`: FSDP with a trained vision tower (every prompt must show an image). Returns (the
    rollouts, [the first generated response]: the placeholder row of a rank that keeps nothing)."""
    rollout, world = cfg.rollout, shards.world_size
    sampling = sampling_params(rollout)
    first: list = []

    def generate(items: list) -> list:
        if check_images:
            check_fsdp_images(items)
        with timer("rollout"):
            results = engine.generate([to_request(it, processor, cfg.data) for it in items], sampling)
        first[:] = results[:1]
        return results

    def score_fn(results: list) -> tuple:
        with timer("reward"):
            return score(reward_model, results, cfg, validate=True)

    roll = collect_rollouts(lambda k: shards.shard(data.next(k * world)), generate, score_fn,
                            rollout.prompts_per_step // world, rollout.group_size, cfg.algo.dynamic_sampling,
                            cfg.algo.max_gen_batches, count=count)
    return roll, first


def per_kind(acc: torch.Tensor, kinds: list, prefix: str) -> dict[str, float]:
    """{prefix/<kind>: mean accuracy} for samples that carry a question kind (shapes data)."""
    out: dict[str, list[float]] = {}
    for a, k in zip(acc.tolist(), kinds):
        if k is not None:
            out.setdefault(f"{prefix}/{k}", []).append(a)
    return {k: sum(v) / len(v) for k, v in out.items()} if len(out) > 1 else {}


@dataclass
class GreedyAnswers:
    """Greedy responses to eval items, scored as `score` scores them."""

    results: list
    scores: torch.Tensor  # [B] with the overlong penalty
    components: dict  # {name: [B]}
    accuracy: torch.Tensor  # [B] 0/1
    details: dict  # the reward's whole details (e.g. `extracted`: the parsed answers)


@torch.no_grad()
def greedy_answers(engine: Any, processor: Any, items: list[VQAItem], reward_model: Any, cfg: Any, chunk: int = 0,
                   progress: Callable[[int], Any] | None = None) -> GreedyAnswers:
    """Greedy responses (temperature 0, rollout.max_new_tokens, rollout.stop) to `items`, scored. `chunk` > 0:
    generated `chunk` prompts at a time, `progress(k)` called after each (the HF engine decodes `batch_size` prompts
    together: chunks of that size are the very same batches); 0: one call."""
    reqs = [to_request(it, processor, cfg.data, n=1) for it in items]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens, stop=cfg.rollout.stop)
    size, res = chunk or max(len(reqs), 1), []
    for lo in range(0, len(reqs), size):
        part = engine.generate(reqs[lo:lo + size], greedy)
        for r in part:
            r.request_index += lo
        res += part
        if progress is not None:
            progress(len(part))
    details: dict = {}
    scores, comps, acc = score(reward_model, res, cfg, details=details)
    return GreedyAnswers(res, scores, comps, acc, details)


def accuracy_metrics(acc: torch.Tensor, items: list[VQAItem]) -> dict[str, float]:
    """{"eval/accuracy": mean, "eval/accuracy/<kind>": ...}: what a run logs of its greedy evaluation."""
    kinds = [it.metadata.get("kind") for it in items]
    return {"eval/accuracy": float(acc.mean()), **per_kind(acc, kinds, "eval/accuracy")}


@torch.no_grad()
def evaluate(engine: Any, processor: Any, items: list[VQAItem], reward_model: Any, cfg: Any, judges: Any = None,
             step: int = 0) -> dict[str, float]:
    """Greedy accuracy on the fixed eval items: {"eval/accuracy": ..., "eval/accuracy/<kind>": ...}; with a
    `JudgePanel` (`log.judges`) every judge scores the same responses and the reward-hacking rule runs (`judge/*`)."""
    if not items:
        return {}
    got = greedy_answers(engine, processor, items, reward_model, cfg)
    out = accuracy_metrics(got.accuracy, items)
    if judges is not None:
        out.update(judges.observe(step, got.scores, completions=[r.text for r in got.results],
                                  metadata=[r.metadata for r in got.results]))
    return out


def reward_components(reward_model: Any, scores: torch.Tensor, comps: dict[str, torch.Tensor],
                      overlong: bool = False) -> tuple[torch.Tensor, list[float]]:
    """(raw scores [n, K] of every reward component, their weights) of the kept samples (`scores` [n] = the
    rewards with the overlong penalty, `comps` their `Rollouts.comps`) for `reward.aggregation`: a composite's
    components in order (a single reward: its score, weight 1), then with `overlong` (reward.overlong_buffer > 0)
    the DAPO overlong penalty (weight 1). K is the same on every rank, also one that kept no sample."""
    n = scores.shape[0]
    names = list(getattr(reward_model, "components", {}))
    pen = comps.get("overlong", torch.zeros(n)) if overlong else torch.zeros(n)
    if names:
        cols, weights = [comps.get(k, torch.zeros(n)) for k in names], [float(reward_model.weights[k]) for k in names]
    else:
        cols, weights = [scores - pen], [1.0]
    if overlong:
        cols, weights = cols + [pen], weights + [1.0]
    return torch.stack([c.float().reshape(-1) for c in cols], dim=1).reshape(n, len(weights)), weights


def check_fsdp_images(items: Sequence[Any]) -> None:
    """FSDP with a trained vision tower: every prompt must show an image. A text-only row leaves the tower without
    gradients on one rank, and FSDP2 reduce-scatters only the gradients that exist, so the collectives would not
    pair (DDP handles it with find_unused_parameters)."""
    bad = [i for i, it in enumerate(items) if not getattr(it, "images", None)]
    if bad:
        raise ValueError(f"dist.strategy=fsdp with a trained vision tower (model.train_vision=true) needs an image in "
                         f"every prompt; {len(bad)} of {len(items)} prompts have none (first: index {bad[0]}); set "
                         f"model.train_vision=false or use dist.strategy=ddp")


def rollout_metrics(ctx: Any, roll: Rollouts, cfg: Any) -> tuple[int, torch.Tensor, dict[str, Any]]:
    """(kept samples over all ranks, kept response lengths over all ranks [n], metrics): reward/{mean, std, accuracy,
    accuracy/<kind>, <component>, nonfinite_samples}, rollout/{dynamic/*, response_length/*, clip_ratio}.
    A collective under several processes (every rank calls it)."""
    metrics: dict[str, Any] = {}
    all_scores, all_acc = ctx.all_gather_tensor(roll.all_scores), ctx.all_gather_tensor(roll.all_acc)
    all_kinds = [k for part in ctx.all_gather_object(roll.all_kinds) for k in part] if ctx.enabled else roll.all_kinds
    n_kept = int(ctx.all_reduce_sum(len(roll.results))) if ctx.enabled else len(roll.results)
    if cfg.reward.on_nonfinite == "drop_sample":
        metrics[NONFINITE_KEY] = int(ctx.all_reduce_sum(roll.nonfinite)) if ctx.enabled else roll.nonfinite
    metrics.update({**finite_stats(all_scores), "reward/accuracy": all_acc.mean(),
                    "rollout/dynamic/rounds": roll.rounds,
                    "rollout/dynamic/kept_groups": n_kept // cfg.rollout.group_size,
                    **per_kind(all_acc, all_kinds, "reward/accuracy")})
    if not n_kept:
        return 0, torch.zeros(0), metrics
    comp_keys = sorted({k for part in ctx.all_gather_object(sorted(roll.comps)) for k in part}) \
        if ctx.enabled else list(roll.comps)
    for k in comp_keys:
        metrics[f"reward/{k}"] = ctx.all_gather_tensor(roll.comps.get(k, torch.zeros(0))).mean()
    lens = torch.tensor([len(r.response_ids) for r in roll.results], dtype=torch.float32)
    all_lens = ctx.all_gather_tensor(lens)
    n_clip = sum(r.finish_reason == "length" for r in roll.results)
    n_clip = int(ctx.all_reduce_sum(n_clip)) if ctx.enabled else n_clip
    metrics.update({"rollout/response_length/mean": all_lens.mean(), "rollout/response_length/max": all_lens.max(),
                    "rollout/clip_ratio": n_clip / n_kept})
    return n_kept, all_lens, metrics


def save_sample_grid(run: Any, step: int, roll: Rollouts, n: int, temperature: float,
                     last_eval: tuple[int, float] | None) -> None:
    """samples/step_<step>.png: the first `n` kept responses (prompt order) with their image, question and reward,
    under a title saying they are training samples drawn at `temperature`, beside the greedy eval accuracy
    `last_eval` = (step, accuracy) of the newest evaluation: a sampled answer is no greedy one."""
    kept, items = roll.results, roll.items
    if not kept or not all(it.images for it in items):
        return
    idx = sorted(range(len(kept)), key=lambda i: kept[i].sample_index)[:n]  # prompts first
    caps = [f"{items[i].prompt.replace('<image>', '')[:40]} -> {kept[i].text[:24]!r} r={float(roll.scores[i]):.2f}"
            for i in idx]
    greedy = (f"greedy eval accuracy {last_eval[1]:.3f} (step {last_eval[0]})" if last_eval is not None
              else "no greedy evaluation yet")
    title = f"training samples of step {step}, sampled at temperature {temperature:g} (not greedy answers); {greedy}"
    run.save_samples(step, [items[i].images[0] for i in idx], caps, title=title)


def shapes_warm_start_pairs(cfg: Any, processor: Any, eos_id: int):
    """`next_pairs(step)` for the format warm start: its own shapes prompts (the RL stream is untouched) with answers
    drawn uniformly from each question's answer vocabulary."""
    stream, rng, tok = ShapesQA(cfg.data, cfg.seed + 104729), random.Random(cfg.seed), processor.tokenizer

    def next_pairs(_step: int):
        items = stream.next(cfg.warm_start.batch_size)
        enc = [encode_prompt(processor, r.prompt_text, r.images) for r in (to_request(it, processor, cfg.data)
                                                                           for it in items)]
        targets = [tok.encode(rng.choice(it.metadata["choices"])) + [eos_id] for it in items]
        return [e.input_ids for e in enc], targets, [e.mm for e in enc]
    return next_pairs


def finish(run: Any, summary: dict) -> dict:
    """The run's summary: first/last eval accuracy (printed), the first-5 / last-5 mean training accuracy and,
    with `log.judges`, the reward-hacking line. A run that evaluated nothing now (resumed at its last step) reports
    its newest logged evaluation as the last eval accuracy."""
    from mmrl.training.judges import judge_summary
    from mmrl.training.overlap import overlap_summary
    from mmrl.training.summary import reward_axis

    rows = run.read_metrics()
    summary.update(judge_summary(rows, "vlm_grpo"))
    summary.update(overlap_summary(rows, "vlm_grpo"))  # rollout.worker=process: the async_* means
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    if evals and "eval_accuracy_last" not in summary:
        summary.update({k.replace("eval/accuracy", "eval_accuracy_last"): v for k, v in evals[-1].items()
                        if k.startswith("eval/accuracy")})
    acc = [r["reward/accuracy"] for r in rows if r.get("reward/accuracy") is not None]
    if acc:
        k = min(5, len(acc))
        summary.update(train_accuracy_first=sum(acc[:k]) / k, train_accuracy_last=sum(acc[-k:]) / k)
    for key in [k for k in summary if k.startswith("eval_accuracy_first")]:
        last = summary.get(key.replace("first", "last"))
        if last is not None:
            print(f"[vlm_grpo] eval accuracy{key[len('eval_accuracy_first'):] or ' (all)'}: first {summary[key]:.3f} "
                  f"-> last {last:.3f}", flush=True)
    return run.finish(summary, reward_axis(run.cfg))


def make_rollout_engine(cfg: Any, states: Any, processor: Any, fsdp_ctx: Any = None, engine: str | None = None
                        ) -> tuple[Any, Any]:
    """(engine, vLLM weight syncer or None) for the `rollout:` section (`engine`: another than rollout.engine, e.g.
    "hf" for the trainer's evaluation when a rollout process generates). `fsdp_ctx`: under FSDP every rank runs the
    same number of decode forwards (finished ranks run masked ones until all are done)."""
    rollout, name = cfg.rollout, engine or cfg.rollout.engine
    if name == "vllm":
        from mmrl.vlm.vllm_engine import make_vllm_rollout

        return make_vllm_rollout(cfg.model.path, states, processor, rollout.vllm_kwargs, cfg.seed)
    kw = {"batch_size": rollout.micro_batch_size}
    if fsdp_ctx is not None:
        kw["step_sync"] = fsdp_ctx.any_rank
    return make_engine(name, states.model, processor, **kw), None
