"""LTX-2 text-to-video with audio (`LTX2Pipeline`) against diffusers' own pipeline: a tiny real-architecture
checkpoint (Gemma 3, text connectors, LTX2VideoTransformer3DModel, the video and audio VAEs, the vocoder) saved in the
diffusers layout and loaded back, at 32 x 64 px and 5 frames (the tiny case rolls out 32 x 32, 3 frames)."""

import json

import numpy as np
import pytest
import torch
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

from mmrl.diffusion.family_checks import assert_lora_targets_exist, assert_sde_log_probs_follow_flow_grpo
from mmrl.diffusion.models import load_flow_model
from mmrl.diffusion.models.ltx2 import LTX2Model
from mmrl.diffusion.sampling import sample_groups
from mmrl.diffusion.sde import sde_step_with_logprob

P = ["a red circle on a blue background", "a green square"]
SEQ = 16
H, W, FRAMES = 32, 64, 5
NO_EXTRA_GUIDANCE = dict(stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0,
                         guidance_rescale=0.0, audio_guidance_rescale=0.0)  # CFG only (what the family implements)


@pytest.fixture(scope="module")
def ltx2_path(tiny_family):
    return tiny_family("LTX2Pipeline")


def _pipeline_final(m, x0, *, steps, gs, audio_gs, output_type="latent"):
    """LTX2Pipeline from the state x0 ([video; audio], normalised): the video latents go in packed (not normalised
    again), the audio de-normalised (the pipeline normalises what it is given); the result in the state's layout."""
    pipe = m.pipe
    video, audio = m.split(x0, H, W)
    ca, mel = m._audio_dims()
    audio4 = (audio * pipe.audio_vae.latents_std + pipe.audio_vae.latents_mean).unflatten(2, (ca, mel)).transpose(1, 2)
    out = pipe(prompt=[P[0]] * 2 + [P[1]] * 2, negative_prompt=[""] * 4, height=H, width=W, num_frames=FRAMES,
               num_inference_steps=steps, guidance_scale=gs, audio_guidance_scale=audio_gs,
               latents=pipe._pack_latents(video), audio_latents=audio4, max_sequence_length=SEQ,
               output_type=output_type, **NO_EXTRA_GUIDANCE)
    if output_type != "latent":
        return out.frames, out.audio
    vae, avae = pipe.vae, pipe.audio_vae
    v = pipe._normalize_latents(out.frames, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    a = (out.audio.transpose(1, 2).flatten(2, 3) - avae.latents_mean) / avae.latents_std
    return m.join(v, a)


@pytest.mark.parametrize("gs, audio_gs", [(3.0, 5.0), (1.0, None)], ids=["cfg", "no_cfg"])
def test_ltx2_ode_rollout_equals_diffusers_pipeline(ltx2_path, gs, audio_gs):
    """Video and audio latents after 3 steps equal LTX2Pipeline's for the same initial noise, with CFG (video 3,
    audio 5) and without; the decoded videos and waveforms (audio VAE + vocoder) too."""
    assert json.loads((ltx2_path / "model_index.json").read_text())["_class_name"] == "LTX2Pipeline"
    m = load_flow_model(ltx2_path, num_frames=FRAMES, max_sequence_length=SEQ,
                        family_options={"audio_guidance_scale": audio_gs})
    assert isinstance(m, LTX2Model) and m.is_video and m.audio_frames() == 5  # round(5 / 24 * 25)
    traj = sample_groups(m, m.encode_prompts(P), 2, num_steps=3, height=H, width=W, guidance_scale=gs,
                         noise_level=0.0, generator=torch.Generator().manual_seed(0))
    assert traj.latents.shape == (4, 4, 4 * 3 * 4 * 8 + 5 * 2 * 2)  # [B, T+1, video 4x3x4x8 + audio 5 x (2x2)]
    ref = _pipeline_final(m, traj.latents[:, 0], steps=3, gs=gs, audio_gs=audio_gs)
    assert (traj.latents[:, -1] - ref).abs().max() < 1e-5
    if gs > 1:
        video, audio = _pipeline_final(m, traj.latents[:, 0], steps=3, gs=gs, audio_gs=audio_gs, output_type="pt")
        assert traj.images.shape == video.shape == (4, FRAMES, 3, H, W)
        assert (traj.images - video).abs().max() < 1e-5
        sound = m.decode_audio(traj.latents[:, -1], H, W)
        assert sound.shape == audio.shape and sound.shape[:2] == (4, 2) and m.audio_sample_rate == 16000
        assert (sound - audio).abs().max() < 1e-5


def test_ltx2_initial_noise_is_the_pipelines(ltx2_path):
    """The same generator gives the pipeline's noise: video [B, C, F', h, w], then audio [B, C_a, L, M] packed."""
    m = load_flow_model(ltx2_path, num_frames=FRAMES, max_sequence_length=SEQ)
    x = m.initial_noise(2, H, W, torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(4)
    video = m.pipe.prepare_latents(2, 4, H, W, FRAMES, dtype=torch.float32, device="cpu", generator=g)
    audio = m.pipe.prepare_audio_latents(2, 2, 5, 8, dtype=torch.float32, device="cpu", generator=g)
    assert torch.equal(x, torch.cat([m.split(x, H, W)[0].flatten(1), audio.flatten(1)], 1))
    assert torch.equal(m.pipe._pack_latents(m.split(x, H, W)[0]), video)


def test_ltx2_sde_log_probs_and_euler_mean(ltx2_path):
    """Every SDE step's log-prob is Flow-GRPO's on the joint state; at noise level 0 the step's mean is the
    pipeline scheduler's Euler step on the same velocity."""
    m = load_flow_model(ltx2_path, num_frames=3, max_sequence_length=SEQ)
    emb = m.encode_prompts(P)
    traj = assert_sde_log_probs_follow_flow_grpo(m, emb, guidance_scale=3.0, height=32, width=32, num_steps=3)
    assert traj.latents.dim() == 3
    sched, c = m.new_scheduler(), m.pipe.scheduler.config  # set as LTX2Pipeline sets it: 2 x 4 x 4 video tokens
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / 3, 3), device="cpu", mu=calculate_shift(
        32, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift))
    sigmas = m.sigmas(3, 32, 32)
    assert torch.equal(sched.sigmas, sigmas)
    x = traj.latents[:, 1]
    with torch.no_grad():
        v = m.velocity(x, sigmas[1], emb.select(traj.prompt_index), guidance_scale=3.0)
    sched.set_begin_index(1)
    euler = sched.step(v, sched.timesteps[1], x, return_dict=False)[0]
    mean = sde_step_with_logprob(x, v, sigmas[1], sigmas[2], noise_level=0.0).mean
    assert (mean - euler).abs().max() < 1e-6


def test_ltx2_lora_targets_and_one_line_errors(ltx2_path):
    m = load_flow_model(ltx2_path, num_frames=3, max_sequence_length=SEQ)
    assert_lora_targets_exist(m)
    with pytest.raises(ValueError, match=r"^rollout.num_frames=4: the LTX-2 VAE takes 2k\+1 frames; use 3 or 5$"):
        m.set_num_frames(4)
    with pytest.raises(ValueError, match=r"^image size 32x48: LTX2Pipeline takes multiples of 32$"):
        m.initial_noise(1, 32, 48)
    x = m.initial_noise(1, 32, 64)  # an evaluation size beside the training one: each state finds its own
    m.sigmas(2, 32, 32)
    with torch.no_grad():
        assert m.velocity(x, 0.5, m.encode_prompts(P[:1])).shape == x.shape
    with pytest.raises(ValueError, match=r"^LTX2Pipeline: sizes 32x64 and 64x32 give states of the same length"):
        m.sigmas(2, 64, 32)
    with pytest.raises(ValueError, match=r"^LTX2Pipeline: no rollout size gives a state of length 7"):
        m.velocity(torch.zeros(1, 7), 0.5, m.encode_prompts(P[:1]))
    with pytest.raises(ValueError, match=r"^LTX2Pipeline: encoding videos into latents is not supported"):
        m.encode_images(torch.zeros(1, 3, 3, 32, 32))
    with pytest.raises(ValueError, match=r"family_options: \['shift'\] not known to LTX2Pipeline \(valid: "
                                         r"\['audio_guidance_scale', 'frame_rate'\]\)"):
        load_flow_model(ltx2_path, family_options={"shift": 3.0})
    with pytest.raises(ValueError, match=r"^model.family_options.frame_rate=0: must be > 0 \(LTX-2 uses 24\)$"):
        load_flow_model(ltx2_path, family_options={"frame_rate": 0})
    m30 = load_flow_model(ltx2_path, num_frames=5, family_options={"frame_rate": 30.0})
    assert m30.audio_frames() == 4  # round(5 / 30 * 25)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_ltx2_dgpo_trains_and_resumes_exactly(ltx2_path, tmp_path, lora, monkeypatch):
    """DGPO is not among test_family_recipes' recipes: the same 2 steps + exact resume on the LTX-2 tiny case with
    the golden metrics' DGPO settings (benchmarks/golden_metrics.py; the other four recipes run in
    test_family_recipes through `tiny_cases`)."""
    from mmrl.config import load_config
    from mmrl.diffusion.dgpo import train

    from . import test_family_recipes as fr

    monkeypatch.setitem(fr.RECIPES, "dgpo", {"update": {"micro_batch_size": 4},
                                             "algo": {"kl": {"coef": 0.1}, "trunc_steps": 1, "num_train_timesteps": 2}})
    full, split = tmp_path / "full", tmp_path / "split"
    torch.manual_seed(0)
    train(load_config(fr._config_dict("dgpo", "ltx2", ltx2_path, full, lora, 2)))
    train(load_config(fr._config_dict("dgpo", "ltx2", ltx2_path, split, lora, 1)))
    train(load_config(fr._config_dict("dgpo", "ltx2", ltx2_path, split, lora, 2)))
    rows = fr.assert_resume_is_exact(full, split)
    assert all(r["policy/grad_norm"] > 0 for r in rows)
    assert (full / "samples" / "step_000001.mp4").is_file()


AUDIO_REWARD = {"motion_amount": 1.0, "loud": {"reward": "audio_loudness", "weight": 0.1}}


@pytest.mark.slow
def test_ltx2_flow_grpo_rewards_sound_and_resumes_exactly(ltx2_path, tmp_path):
    """Flow-GRPO on the tiny case with a video reward and an audio reward: the rollout decodes the sound for it,
    2 steps = 1 step + a resumed step (metrics and weights), and every grid sample has its WAV and its MP4 with an
    AAC track."""
    import av

    from mmrl.config import load_config
    from mmrl.diffusion.flow_grpo import train

    from . import test_family_recipes as fr

    full, split = tmp_path / "full", tmp_path / "split"
    for out, steps in ((full, 2), (split, 1), (split, 2)):
        d = fr._config_dict("flow_grpo", "ltx2", ltx2_path, out, True, steps)
        d["reward"]["components"] = AUDIO_REWARD
        train(load_config(d))
    rows = fr.assert_resume_is_exact(full, split)
    assert all(r["policy/grad_norm"] > 0 and -100 < r["reward/loud"] < 0 for r in rows)
    assert rows[0]["reward/mean"] == pytest.approx(rows[0]["reward/motion_amount"] + 0.1 * rows[0]["reward/loud"])
    samples = full / "samples"
    n = len(list(samples.glob("step_000001_s*.wav")))  # one per grid prompt
    assert n > 1 and {p.name for p in samples.glob("step_000001*")} == {"step_000001.mp4"} | {
        f"step_000001_s{i}.{ext}" for i in range(n) for ext in ("mp4", "wav")}
    with av.open(str(samples / "step_000001_s0.mp4")) as c:
        assert [s.type for s in c.streams] == ["video", "audio"] and c.streams.audio[0].rate == 16000


def test_ltx2_video_reward_never_decodes_sound(ltx2_path, tmp_path, monkeypatch):
    """Without an audio reward a rollout does not decode the sound (no vocoder cost for video-only rewards)."""
    from mmrl.config import load_config
    from mmrl.diffusion.flow_grpo import train

    from . import test_family_recipes as fr

    def refuse(*args, **kwargs):
        raise AssertionError("decode_audio called")

    monkeypatch.setattr(LTX2Model, "decode_audio", refuse)
    d = fr._config_dict("flow_grpo", "ltx2", ltx2_path, tmp_path / "run", True, 1)
    train(load_config({**d, "log": {"sample_every": 0}}))
    assert fr.metrics_rows(tmp_path / "run")[0]["reward/motion_amount"] >= 0


def test_ltx2_eval_saves_and_scores_the_sound(ltx2_path, tmp_path):
    """`mmrl eval` of the tiny case with an audio reward: each sample's MP4 carries its sound, a WAV lies beside it,
    and the report's audio scores are those of the decoded waveform (recomputed here)."""
    import wave

    import av
    import numpy as np

    from mmrl.config import load_config
    from mmrl.eval import run_eval
    from mmrl.eval.harness import prompt_seed
    from mmrl.rewards import load

    from . import test_family_recipes as fr

    d = fr._config_dict("flow_grpo", "ltx2", ltx2_path, tmp_path / "run", True, 1)
    d["reward"]["components"] = AUDIO_REWARD
    cfg = load_config(d)
    report = run_eval(cfg, None, prompts=fr.PROMPTS, out=tmp_path / "ev", max_prompts=2)
    m = load_flow_model(ltx2_path, num_frames=3, max_sequence_length=16)
    for i, p in enumerate(report["per_prompt"]):
        clip = tmp_path / "ev" / p["images"][0]
        assert clip.with_suffix(".wav").is_file()
        with av.open(str(clip)) as c:
            assert [s.type for s in c.streams] == ["video", "audio"]
        traj = sample_groups(m, m.encode_prompts([p["prompt"]]), 1, num_steps=cfg.rollout.eval_num_steps, height=32,
                             width=32, guidance_scale=cfg.rollout.eval_guidance_scale, noise_level=0.0,
                             generator=torch.Generator().manual_seed(prompt_seed(cfg.seed, i)), decode_audio=True)
        with wave.open(str(clip.with_suffix(".wav"))) as w:  # the report is recomputable from the file alone
            pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2").reshape(-1, w.getnchannels()).T / 32767
            rate = w.getframerate()
        saved = torch.from_numpy(pcm.astype(np.float32))[None]
        assert rate == 16000 and (saved - traj.audio).abs().max() <= 0.5 / 32767 + 1e-7  # the decoded sound, 16-bit
        loud = load("audio_loudness")(audio=saved, sample_rate=rate).scores.item()
        assert p["components"]["loud"][0] == pytest.approx(loud, abs=1e-6)
